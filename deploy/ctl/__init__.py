"""start.sh / stop.sh behind the scenes: read deploy/.env, check, prepare, start (docker compose per machine or
`twinspark up`), wait for /health, smoke-test, print the endpoint; and stop again.

It needs only python3 on the host (twinspark itself may live only inside the image): the standard library and
the stdlib-only modules of the checkout it runs from (the launcher's `services.launcher.ports`, the services' flag
declarations `services.common.shared_flags` and `services.common.flags`, which writes them as TWINSPARK_*).
"""
