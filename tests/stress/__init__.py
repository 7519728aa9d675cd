"""The server stress suite: a real `chunkserve serve` on loopback, driven as a hostile or unlucky
client would drive it. `make stress` runs it in full (tests/stress/run.py); test_short.py runs a
short form of the fuzz, disconnect, overload and SIGTERM phases inside `make test`."""
