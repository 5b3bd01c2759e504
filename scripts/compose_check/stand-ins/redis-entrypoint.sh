#!/bin/sh
# As the official image: `redis-server ARGS` runs Redis with protected mode off; any other command runs as given.
set -e
if [ "$1" = redis-server ]; then
  shift
  exec redis-server "$@" --protected-mode no
fi
exec "$@"
