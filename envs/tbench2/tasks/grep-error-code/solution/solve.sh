#!/bin/bash
grep FATAL /app/server.log | sed -E 's/.*code=([A-Z0-9]+).*/\1/' > /app/answer.txt
