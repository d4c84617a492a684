"""tandem.control: the cluster state in Redis, shared by routers and workers.

Modules:
    state         ClusterState (connection, key schema), WorkerRecord, worker records and leases
    lease         LeaseKeeper: a worker's lease renewed in the background, self-fencing
    kv_events     KVEventPublisher / KVEventReader: KV cache events on Redis streams
    reservations  Reservations: atomic select-and-reserve of in-flight requests per worker
    journal       RequestJournal: running requests' parameters and tokens, for migration
    load_reports  LoadReporter / LoadReader: what routers observe, for the planner
    election      LeaderElection: one active instance of a singleton (the planner)
    planner       Planner: sizes the prefill and decode pools (autoscaling)
    redis_server  EmbeddedRedis: a redis-server child process (single host, tests)

Imports no Ray, gRPC, torch, router or worker code: both sides of the cluster use it.
"""
