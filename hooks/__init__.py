"""Alert hooks: where GPU failures enter the controller.

An HTTP server (``recovery hooks``) with one endpoint per alert source (Prometheus Alertmanager,
GPU health events, kernel log lines). Each request is authenticated, validated strictly, turned
into NodeFailureAlerts and handed to Temporal so that every node has exactly one incident; see
docs/alert-hooks.md.
"""
