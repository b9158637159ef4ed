#!/bin/bash
tail -n +2 /app/sales.csv | awk -F, '{t[$1] += $2} END {for (c in t) print c, t[c]}' | sort > /app/report.txt
sort -k2,2nr /app/report.txt | head -n1 | cut -d' ' -f1 > /app/top.txt
