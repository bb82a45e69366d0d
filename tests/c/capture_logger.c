/* A stand-in for NCCL's ncclDebugLog: C-variadic (which Rust cannot define),
 * it formats like NCCL does and records every line so tests can inspect them. */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define WEFT_CAP_LINES 256
#define WEFT_CAP_TEXT 1024

struct weft_cap_line {
  int level;
  unsigned long flags;
  char file[256];
  int line;
  char fmt[64];
  char text[WEFT_CAP_TEXT];
};

static struct weft_cap_line lines[WEFT_CAP_LINES];
static int count;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

void weft_test_capture_logger(int level, unsigned long flags, const char *file, int line,
                              const char *fmt, ...) {
  pthread_mutex_lock(&lock);
  if (count < WEFT_CAP_LINES) {
    struct weft_cap_line *l = &lines[count++];
    l->level = level;
    l->flags = flags;
    snprintf(l->file, sizeof l->file, "%s", file ? file : "(null)");
    l->line = line;
    snprintf(l->fmt, sizeof l->fmt, "%s", fmt ? fmt : "(null)");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(l->text, sizeof l->text, fmt, ap);
    va_end(ap);
  }
  pthread_mutex_unlock(&lock);
}

int weft_test_capture_count(void) {
  pthread_mutex_lock(&lock);
  int n = count;
  pthread_mutex_unlock(&lock);
  return n;
}

/* Copies line i out; returns 0, or -1 if there is no such line. */
int weft_test_capture_get(int i, int *level, unsigned long *flags, int *line, char *file,
                          char *fmt, char *text) {
  pthread_mutex_lock(&lock);
  int rc = -1;
  if (i >= 0 && i < count) {
    *level = lines[i].level;
    *flags = lines[i].flags;
    *line = lines[i].line;
    memcpy(file, lines[i].file, sizeof lines[i].file);
    memcpy(fmt, lines[i].fmt, sizeof lines[i].fmt);
    memcpy(text, lines[i].text, sizeof lines[i].text);
    rc = 0;
  }
  pthread_mutex_unlock(&lock);
  return rc;
}

/* A stand-in for NCCL's logger that writes each line to stderr at once, with
 * the time and the pid, as NCCL's does: for processes whose log a test keeps
 * in a file (the soak's ranks). */
void weft_test_stderr_logger(int level, unsigned long flags, const char *file, int line,
                             const char *fmt, ...) {
  (void)flags;
  (void)file;
  (void)line;
  char text[WEFT_CAP_TEXT];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  fprintf(stderr, "%ld.%03ld [%d] %s %s\n", (long)t.tv_sec, t.tv_nsec / 1000000L, (int)getpid(),
          level == 2 ? "WARN" : level == 3 ? "INFO" : "TRACE", text);
}
