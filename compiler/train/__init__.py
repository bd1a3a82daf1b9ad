"""Training on top of kiln's Level-1 graphs: Mixture-of-Depths routers distilled from the dense model."""
