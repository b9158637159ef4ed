#!/bin/bash
printf '%s\n' '1.4.2' > /app/version.txt
