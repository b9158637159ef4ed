#!/bin/bash
rm /app/debug.log
