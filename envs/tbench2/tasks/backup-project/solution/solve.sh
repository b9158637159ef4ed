#!/bin/bash
cd /app/project
find . -type f ! -name '*.tmp' | sed 's|^\./||' | sort > /tmp/files.txt
tar -czf /app/backup.tar.gz -T /tmp/files.txt
wc -l < /tmp/files.txt > /app/backup_count.txt
