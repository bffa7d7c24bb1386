"""The application: training loop, checkpoints, data, and the command line."""
