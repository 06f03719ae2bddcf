"""A reference training job and its checkpoint library, for the recovery controller to drive.

Standard library only: users copy this package into their own training jobs.

- ``trainer.checkpoint``: atomic, self-verifying checkpoints and the progress files the
  controller reads from a job's run directory.
- ``trainer.job``: a small deterministic training loop that resumes from the latest complete
  checkpoint and answers SIGUSR1 / SIGTERM with emergency checkpoints.
"""
