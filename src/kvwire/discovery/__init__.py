"""Fleet discovery on etcd: engines register under leases (``registrar``); the router watches (``watcher``)
and builds its view from the records (``kvwire.router.fleet``)."""
