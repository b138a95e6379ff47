"""The engines that execute the core's schedule: the multi-process pipeline, the in-process one."""
