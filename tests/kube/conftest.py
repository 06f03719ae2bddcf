"""Every test here that talks to Kubernetes runs twice on the in-repo server: straight to it, and
through the recording proxy (kubesim/proxy.py) that stands in front of a real cluster when
RECOVERY_TEST_KUBECONFIG names one; so the proxy is held to the same tests the server is."""

import os

from tests.kubeapi.fixtures import REAL_CLUSTER_ENV


def pytest_generate_tests(metafunc):
    if "kube_api" in metafunc.fixturenames and not os.environ.get(REAL_CLUSTER_ENV):
        metafunc.parametrize("kube_api", ["direct", "via-proxy"], indirect=True)
