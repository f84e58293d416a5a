"""The network layer on hivemind: DHT, run records, the averager, the all-reduce, codecs and transport."""
