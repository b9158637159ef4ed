#!/bin/bash
printf '%s\n' 'Ada Lovelace' > /app/name.txt
