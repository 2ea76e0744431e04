"""Several tensor-parallel replicas behind one HTTP address, on Ray Serve (docs/replicas.md).

router_policy.py is plain Python; the other modules import ray.serve when used."""
