#!/bin/bash
cut -d' ' -f1 /app/access.log | sort -u | wc -l > /app/unique.txt
