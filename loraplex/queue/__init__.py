"""Redis streams: key names (keys.py), the envelope codec, producer, consumer group, results + notify."""
