"""Native routes under /v1."""
