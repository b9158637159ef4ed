#!/bin/bash
echo ready > /app/state.txt
(sleep 100000 &)
tail -f /dev/null
