#!/bin/bash
mkdir -p /app/output
