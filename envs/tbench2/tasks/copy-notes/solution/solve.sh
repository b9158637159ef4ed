#!/bin/bash
cp /app/notes.txt /app/notes.old
