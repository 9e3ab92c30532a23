"""`twinspark up` / `twinspark down`: run every role of one replica as its own child process on this machine.

- `plan.py`        the launch plan (which processes, which argv, which ports): a pure function, unit-tested; each
                   child's argv is its settings object, `up`'s values passed on and the addresses it derives.
- `addresses.py`   listen addresses as clients reach them (wildcards, IPv6 brackets).
- `ports.py`       free-port picking and "is this port taken" checks.
- `procs.py`       process and process-group probes (Linux /proc where it helps, plain signals otherwise).
- `state.py`       the state dir: `up.json`, the supervisor lock, default locations.
- `tiny_cache.py`  the tiny checkpoint served when no `--model` is given, made once and cached atomically.
- `supervisor.py`  starts the children, waits for health, supervises (restarts a child that exits — the ranks as one
                   group — up to `--max-restarts` per role), stops them (process groups, SIGTERM → SIGKILL).
- `settings.py`    `up`'s and `down`'s flags, as the frozen settings the commands run on.
- `cli.py`         `register(subparsers)` adding `up` and `down` (also runnable as `python -m services.launcher`).

Nothing here imports torch: `up` must start (and `down` answer) in a blink.
"""
