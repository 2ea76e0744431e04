"""The Ray side: device and collective set-up, placement of a replica's shards, the
engine-core actor (rank 0), the driver's client of it, and the HTTP-hosting driver actor."""
