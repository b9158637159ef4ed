#!/bin/bash
echo done > /app/done.txt
yes "this line repeats forever"
