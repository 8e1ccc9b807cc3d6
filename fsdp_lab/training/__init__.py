"""Training for real: the course GPT, launching ranks, and the loop behind `fsdp-lab train` and `demo`."""
