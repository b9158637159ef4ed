#!/bin/bash
printf '%s\n' 'all systems go' > /app/status.txt
