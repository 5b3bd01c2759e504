#!/bin/sh
# As the official image: an empty data folder is initialised with POSTGRES_USER (password POSTGRES_PASSWORD) and
# POSTGRES_DB, then `postgres` runs as the postgres user, listening on every address with password logins.
set -e
: "${POSTGRES_USER:=postgres}" "${POSTGRES_DB:=$POSTGRES_USER}"
mkdir -p "$PGDATA" /run/postgresql
chown -R postgres:postgres "$PGDATA" /run/postgresql
chmod 700 "$PGDATA"
as_postgres() { runuser -u postgres -- "$@"; }
if [ "$1" = postgres ] && [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp) && printf '%s\n' "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD is required}" > "$pwfile"
  chown postgres "$pwfile"
  # UTF8 as the official image (its en_US.utf8): without a locale initdb picks SQL_ASCII, whose text psycopg returns
  # as bytes (SQLAlchemy then fails on the server version string).
  as_postgres initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pwfile" -A scram-sha-256 --auth-local=trust \
    -E UTF8 --locale=C.UTF-8
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  as_postgres pg_ctl -D "$PGDATA" -w -o "-c listen_addresses=''" start
  if [ "$POSTGRES_DB" != postgres ]; then as_postgres createdb -U "$POSTGRES_USER" "$POSTGRES_DB"; fi
  as_postgres pg_ctl -D "$PGDATA" -w -m fast stop
fi
if [ "$1" = postgres ]; then
  shift
  exec runuser -u postgres -- postgres -D "$PGDATA" -c listen_addresses='*' "$@"
fi
exec "$@"
