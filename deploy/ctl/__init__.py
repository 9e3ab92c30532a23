"""start.sh / stop.sh behind the scenes: read deploy/.env, check, prepare, start (docker compose per machine or
`twinspark up`), wait for /health, smoke-test, print the endpoint; and stop again.

Standard library only: it runs on a host where twinspark itself may live only inside the image.
"""
