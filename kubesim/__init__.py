"""A Kubernetes API server with real Kubernetes semantics, driven by the unmodified official
`kubernetes` client over HTTP(S), and the cluster parts around it: server.py (KubeApiServer),
simulators.py (Kubelet, Provisioner). No kube-apiserver can run on the machines this project is
built on, so the tests (tests/kubeapi/fixtures.py) and `recovery drill --k8s` both use it. What it
claims, each claim with its test, and what it does not do: docs/kubernetes-test-server.md.
"""
