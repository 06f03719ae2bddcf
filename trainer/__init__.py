"""A reference training job and its checkpoint library, for the recovery controller to drive.

Standard library only (but for the PyTorch job): users copy this package into their own jobs.

- ``trainer.checkpoint``: atomic, self-verifying checkpoints and the progress files the
  controller reads from a job's run directory.
- ``trainer.job``: a small deterministic training loop that resumes from the latest complete
  checkpoint and answers SIGUSR1 / SIGTERM with emergency checkpoints.
- ``trainer.torch_job``: a real distributed PyTorch job (gloo, DDP) with DCP checkpoints, which
  knows nothing of this project: what the controller reads of it, any job can write.
"""
