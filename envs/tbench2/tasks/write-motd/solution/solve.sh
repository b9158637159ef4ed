#!/bin/bash
printf '%s\n' 'Welcome back' > /app/motd.txt
