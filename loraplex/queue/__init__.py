"""Redis streams: key names (keys.py), the envelope codec, producer, consumer group, results + notify, and an
adapter's hand-over between pools (handoff.py)."""
