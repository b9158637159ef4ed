#!/bin/bash
wc -l < /app/data/words.txt > /app/count.txt
