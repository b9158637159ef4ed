#!/bin/bash
printf '%s\n' 'buy milk' > /app/todo.txt
