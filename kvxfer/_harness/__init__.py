"""kvxfer's own test harness: what kvxfer's tests use and a plugin's tests do not.

The kit for plugin authors is :mod:`kvxfer.testing` (conformance suites, buffers, fuzz and
soak campaigns, the peer process, the etcd and Mooncake masters, fake CUDA). This package holds
the rest: the fault injector, network namespaces, the store-kill child, the directory worker,
engine-shaped caches and prover probes. Nothing outside kvxfer's own tests may rely on it.
"""
