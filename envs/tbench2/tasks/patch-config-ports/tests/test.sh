#!/bin/bash
# Verifier: checks every file; CHECK_MODE comes from [verifier.env].
mkdir -p /logs/verifier
cd /app/etc || { echo 0 > /logs/verifier/reward.txt; exit 0; }
ok=1
[ "$CHECK_MODE" = "strict" ] || ok=0
[ "$(cat web.conf)" = "$(printf 'name=web\nport=9090')" ] || ok=0
[ "$(cat api/v1/api.conf)" = "$(printf 'name=api\nport=9090\nworkers=4')" ] || ok=0
[ "$(cat cache/cache.conf)" = "port=9090" ] || ok=0
[ "$(cat db/db.conf)" = "$(printf 'name=db\nport=5432')" ] || ok=0
[ "$(cat api/v1/api.conf.bak)" = "port=8080" ] || ok=0
[ "$(cat /app/changed.txt 2>/dev/null)" = "$(printf 'api/v1/api.conf\ncache/cache.conf\nweb.conf')" ] || ok=0
echo $ok > /logs/verifier/reward.txt
