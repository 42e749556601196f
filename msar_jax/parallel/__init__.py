"""Scale-out: the device mesh and logical sharding rules (``mesh``), the SPMD pipeline
(``pipeline``) and multi-host start-up (``multihost``). See docs/parallelism.md."""
