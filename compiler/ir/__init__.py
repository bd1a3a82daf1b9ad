"""kiln's IR: the op set (reference and fake kernels), the frontend spec -> fx graph, the readable IR text."""
