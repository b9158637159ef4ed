#!/bin/bash
rm /app/scratch.tmp
