#!/bin/bash
awk '{ s += $1 } END { print s }' /app/nums.txt > /app/sum.txt
