"""torch.compile(model, backend="kiln"): normalize Dynamo graphs into kiln ops, regions, explain."""
