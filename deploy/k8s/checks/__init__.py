"""Offline checks of the Kubernetes deployment (Helm chart and service images), one module per job.

`cli.run_all` runs them all; deploy/k8s/check.py is the command line (`make k8s-check`).
"""
