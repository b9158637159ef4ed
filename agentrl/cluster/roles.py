"""Node roles as Ray custom resources, and the error a cluster that cannot run a plan raises.

A node that trains advertises `agentrl_train`, one that serves advertises `agentrl_inference`
(`ray start --resources '{"agentrl_train": 1000}'`; scripts/start_cluster.sh). A local run gives its
one node both, so the same placement code runs for real everywhere.
"""

from __future__ import annotations

TRAIN_RESOURCE = "agentrl_train"
INFER_RESOURCE = "agentrl_inference"
ROLE_UNITS = 1000  # units a node advertises per role; one bundle takes one


class ClusterError(RuntimeError):
    """The cluster cannot run the plan; the message says what is missing and how to get it."""
