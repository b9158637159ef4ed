#!/bin/bash
printf 'Hello, agentrl!\n' > /app/greeting.txt
