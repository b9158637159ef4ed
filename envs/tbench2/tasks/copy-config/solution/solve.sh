#!/bin/bash
cp /app/config.ini /app/config.bak
