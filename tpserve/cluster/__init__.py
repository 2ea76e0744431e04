"""The Ray side: device and collective set-up, shard workers, the engine loop and the driver."""
