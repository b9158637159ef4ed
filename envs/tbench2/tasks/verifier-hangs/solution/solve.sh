#!/bin/bash
echo x > /app/x.txt
