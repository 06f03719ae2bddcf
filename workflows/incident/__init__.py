"""The parts of an incident, which NodeRecoveryWorkflow (workflows/node_recovery.py) puts together
into the recovery's story. Each is deterministic workflow code or pure:

- timeline: the phases, each ended when its work was done (pure);
- steps: each step a phase of the timeline, indexed for the Web UI, raced against an abort;
- gates: where the incident waits for a person (approvals, answers, aborts), verified and audited;
- slurm_calls: how the fence calls Slurm, within the incident's first workflow task when it can;
- jobs: the work on the node's jobs (signal, grace, requeue and verify through the job's recovery);
- hot_spares and kubernetes: the node's fence and replacement on each platform;
- outcome: the outcome's text, its kind, and who hears of it (pure).
"""
