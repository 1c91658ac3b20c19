"""What every layer of ragtrain runs on, and which knows nothing of ragtrain's config or models: the config error
(errors.py), the console and its loggers (console.py), the lock of a run folder (run_lock.py) and this process's
resident memory (rss.py)."""
