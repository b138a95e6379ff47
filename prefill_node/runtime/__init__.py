"""Multi-process pipeline runtime: stage processes on torch.distributed, leader engine, launcher."""
