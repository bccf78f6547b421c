#ifndef DSH_WAITING_H
#define DSH_WAITING_H

#include <sys/types.h>

/* What the command's input is: a terminal (DEV its st_rdev) or a pipe (DEV and INO of our end). */
void input_identity(int is_terminal, dev_t dev, ino_t ino);
/* 1 when some process of the subtree is blocked reading the input at this moment. */
int input_waiter(void);

#endif
