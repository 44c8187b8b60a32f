using System;
using System.Collections.Generic;
using System.Diagnostics;
using System.Globalization;
using System.IO;
using System.Runtime.InteropServices;
using System.Text;
using System.Threading;
using System.Threading.Tasks;

namespace ChatCli
{
    public static class Program
    {
        public const int ExitOk = 0;
        public const int ExitStreamError = 1;
        public const int ExitHttpError = 2;
        public const int ExitKeyNotSent = 2;  // refused before any request: the key would travel in clear
        public const int ExitConnect = 3;
        public const int ExitUsage = 64;      // EX_USAGE from sysexits.h
        public const int ExitCancelled = 130; // 128 + SIGINT, as shells report Ctrl+C
        public const int ExitStdoutClosed = 141; // 128 + SIGPIPE: the reader of stdout went away

        // mcs only knows C# 7.0, which has no async Main: Main waits on RunAsync.
        public static int Main(string[] args)
        {
            var utf8 = new UTF8Encoding(false); // no BOM
            var stdout = new StreamWriter(Console.OpenStandardOutput(), utf8);
            var stderr = new StreamWriter(Console.OpenStandardError(), utf8);
            stderr.AutoFlush = true;
            int code;
            try
            {
                code = RunAsync(args, stdout, stderr).GetAwaiter().GetResult();
            }
            finally
            {
                try { stdout.Flush(); }
                catch (IOException) { } // stdout already closed, e.g. `chat --help | head -1`
            }
            // Returning from Main waits for other threads, and under Mono that wait now and then
            // never ended: after Ctrl+C (Console.CancelKeyPress runs on a thread of its own; about 1
            // run in 50 here) and, rarely, on a loaded machine after a normal end too. Mono's
            // Environment.Exit runs the runtime's shutdown, which hung the same way once (a CI run,
            // both cores busy: the answer printed, the process never ended). Everything is written
            // by now, so under Mono on Unix the process ends at once (libc's _exit); elsewhere, or
            // without it, Environment.Exit. So every path leaves this way.
            if (Type.GetType("Mono.Runtime") != null && Environment.OSVersion.Platform == PlatformID.Unix)
            {
                try { stderr.Flush(); _exit(code); }
                catch (DllNotFoundException) { }
                catch (EntryPointNotFoundException) { }
            }
            Environment.Exit(code);
            return code; // not reached
        }

        [DllImport("libc")]
        static extern void _exit(int status);

        static async Task<int> RunAsync(string[] args, TextWriter stdout, TextWriter stderr)
        {
            Options options;
            try
            {
                options = Options.Parse(args, Environment.GetEnvironmentVariable, ReadRedirectedStdin);
            }
            catch (Options.UsageException e)
            {
                stderr.WriteLine("chat: " + e.Message);
                stderr.WriteLine(Options.Usage);
                return ExitUsage;
            }
            if (options.Help)
            {
                try
                {
                    stdout.WriteLine(Options.Usage);
                    stdout.Flush();
                }
                catch (IOException) { return ExitStdoutClosed; }
                return ExitOk;
            }

            var url = new Uri(options.Url);
            bool functionKey = options.Key != null, callerKey = options.CallerKey != null;
            if ((functionKey || callerKey) && !options.AllowInsecureKey && Options.KeyWouldTravelInClear(url))
            {
                string which = functionKey && callerKey ? "the function key and the caller key" :
                               functionKey ? "the function key" : "the caller key";
                stderr.WriteLine("chat: refusing to send " + which + " in clear text over http:// to " +
                                 url.Host + ", which is not a loopback address. Use an https:// URL, or pass " +
                                 "--allow-insecure-key to send " + (functionKey && callerKey ? "them" : "it") + " anyway.");
                return ExitKeyNotSent;
            }

            ChatRequest body = null;
            if (options.Resume == null)
            {
                body = new ChatRequest { Model = options.Model };
                if (options.System != null)
                {
                    body.Messages = new List<ChatMessage>
                    {
                        new ChatMessage { Role = "system", Content = options.System },
                        new ChatMessage { Role = "user", Content = options.Prompt },
                    };
                }
                else
                {
                    body.Prompt = options.Prompt;
                }
            }

            // Ctrl+C cancels the token, which aborts the HTTP request (and, for a resumable stream,
            // leads to POST streams/ID/cancel below: a hang-up no longer stops the generation).
            // A second Ctrl+C, if the first one has not ended the run yet, exits at once.
            var cts = new CancellationTokenSource();
            int ctrlC = 0;
            Action interrupt = () =>
            {
                if (Interlocked.Exchange(ref ctrlC, 1) == 1) Environment.Exit(ExitCancelled);
                // Cancel on a pool thread: cancelling runs the callbacks, which can resume the
                // stream loop on this very thread, and the handler should return at once.
                ThreadPool.QueueUserWorkItem(_ => cts.Cancel());
            };
            Console.CancelKeyPress += (sender, e) =>
            {
                e.Cancel = true;
                interrupt();
            };

            var clock = Stopwatch.StartNew();
            TimeSpan? firstDelta = null;
            bool wroteText = false;
            bool stdoutClosed = false;
            ChatResult result;
            string cancelFailure = null;
            using (var client = new ChatClient(options.Url, options.Key, options.CallerKey))
            {
                client.MaxReconnects = options.Retries;
                if (options.Stats) client.Log = note => stderr.WriteLine("chat: " + note);
                client.StreamStarted = id =>
                {
                    if (options.Stats) stderr.WriteLine("chat: resumable stream " + id);
                    // Mono runs Console.CancelKeyPress only when stdin and stdout are both terminals;
                    // otherwise SIGINT ends the process at once, and a resumable stream would go on
                    // until the app gives it up. So for those, Mono's own UnixSignal catches SIGINT.
                    if (Console.IsInputRedirected || Console.IsOutputRedirected) MonoSignals.OnSigint(interrupt);
                };
                Action<string> onDelta = delta =>
                {
                    if (firstDelta == null) firstDelta = clock.Elapsed;
                    if (stdoutClosed) return;
                    try
                    {
                        stdout.Write(delta);
                        stdout.Flush(); // show each piece the moment it arrives
                        wroteText = true;
                    }
                    catch (IOException)
                    {
                        // Nobody reads our output any more (`chat ... | head -1`):
                        // abort the request like Ctrl+C does, so the server stops too.
                        stdoutClosed = true;
                        cts.Cancel();
                    }
                };
                if (options.Resume != null)
                {
                    client.StreamStarted(options.Resume);
                    result = await client.ResumeAsync(options.Resume, options.LastEventId, onDelta, cts.Token).ConfigureAwait(false);
                }
                else
                {
                    result = await client.StreamAsync(body, onDelta, cts.Token).ConfigureAwait(false);
                }
                if ((result.Outcome == Outcome.Cancelled || stdoutClosed) && result.StreamId != null)
                    cancelFailure = await client.CancelAsync(result.StreamId, TimeSpan.FromSeconds(3)).ConfigureAwait(false);
            }
            TimeSpan total = clock.Elapsed;
            if (stdoutClosed) return ExitStdoutClosed;

            bool streamed = result.Outcome == Outcome.Done || result.Outcome == Outcome.StreamError ||
                            result.Outcome == Outcome.Truncated || wroteText;
            // The reply is followed by exactly one newline; a cut-off reply gets one too,
            // so that the shell prompt starts on a line of its own.
            if (result.Outcome == Outcome.Done || wroteText)
            {
                stdout.Write("\n");
                stdout.Flush();
            }

            if (options.Stats && (streamed || result.StreamId != null)) PrintStats(stderr, result, firstDelta, total);

            // How to go on with a stream that ended early (the app keeps it for a while).
            string resumeHint = result.StreamId == null ? "" :
                " To continue it: chat --resume " + result.StreamId +
                (result.LastEventId > 0 ? " --last-event-id " + result.LastEventId.ToString(CultureInfo.InvariantCulture) : "");
            switch (result.Outcome)
            {
                case Outcome.Done:
                    if (result.Done.FinishReason == "cancelled")
                    {
                        stderr.WriteLine("chat: the app cancelled the stream before its end (finish reason cancelled)");
                        return ExitStreamError;
                    }
                    return ExitOk;
                case Outcome.StreamError:
                    stderr.WriteLine("chat: the stream ended with an error: " + Describe(result.Error, result.Message));
                    return ExitStreamError;
                case Outcome.Truncated:
                    stderr.WriteLine("chat: " + result.Message + (resumeHint.Length == 0 ? "" : "." + resumeHint));
                    return ExitStreamError;
                case Outcome.HttpError:
                    stderr.WriteLine("chat: HTTP " + result.HttpStatus +
                                     (string.IsNullOrEmpty(result.HttpReason) ? "" : " " + result.HttpReason) +
                                     ": " + Describe(result.Error, result.Message) +
                                     (options.Resume != null && result.HttpStatus == 404 ? " (the stream is unknown or has expired)" : ""));
                    return ExitHttpError;
                case Outcome.ConnectFailed:
                    stderr.WriteLine("chat: could not connect to " + options.Url + ": " + result.Message);
                    return ExitConnect;
                case Outcome.Cancelled:
                    if (result.StreamId != null && cancelFailure != null)
                        stderr.WriteLine("chat: could not cancel stream " + result.StreamId + ": " + cancelFailure +
                                         " (the app gives up a stream that nobody reads after RESUME_ABANDON_SECONDS)");
                    stderr.WriteLine("chat: cancelled");
                    return ExitCancelled;
                default:
                    throw new InvalidOperationException("unhandled outcome " + result.Outcome);
            }
        }

        /// <summary>The redirected standard input as UTF-8 text, or null when stdin is a terminal.</summary>
        static string ReadRedirectedStdin()
        {
            if (!Console.IsInputRedirected) return null;
            using (var reader = new StreamReader(Console.OpenStandardInput(), new UTF8Encoding(false)))
                return reader.ReadToEnd();
        }

        static string Describe(ErrorDetail error, string fallback)
        {
            if (error == null) return string.IsNullOrEmpty(fallback) ? "(no details)" : fallback;
            var sb = new StringBuilder();
            sb.Append(string.IsNullOrEmpty(error.Message) ? "(no message)" : error.Message);
            var notes = new List<string>();
            if (!string.IsNullOrEmpty(error.Type)) notes.Add("type " + error.Type);
            if (!string.IsNullOrEmpty(error.Param)) notes.Add("param " + error.Param);
            if (error.Retryable.HasValue) notes.Add(error.Retryable.Value ? "retryable" : "not retryable");
            if (notes.Count > 0) sb.Append(" (").Append(string.Join(", ", notes)).Append(')');
            return sb.ToString();
        }

        static void PrintStats(TextWriter stderr, ChatResult result, TimeSpan? firstDelta, TimeSpan total)
        {
            var inv = CultureInfo.InvariantCulture;
            stderr.WriteLine("stats: time to first delta: " +
                             (firstDelta.HasValue ? firstDelta.Value.TotalMilliseconds.ToString("0", inv) + " ms" : "none"));
            stderr.WriteLine("stats: total time: " + total.TotalMilliseconds.ToString("0", inv) + " ms");
            stderr.WriteLine("stats: deltas: " + result.Deltas.ToString(inv));

            string finish;
            if (result.Outcome == Outcome.Done)
                finish = string.IsNullOrEmpty(result.Done.FinishReason) ? "(none)" : result.Done.FinishReason;
            else if (result.Outcome == Outcome.StreamError)
                finish = "error";
            else if (result.Outcome == Outcome.Cancelled)
                finish = "cancelled";
            else
                finish = "incomplete";
            stderr.WriteLine("stats: finish reason: " + finish);

            Usage usage = result.Outcome == Outcome.Done ? result.Done.Usage : null;
            if (usage == null)
                stderr.WriteLine("stats: tokens: unknown");
            else
                stderr.WriteLine("stats: tokens: prompt " + Count(usage.PromptTokens) +
                                 ", completion " + Count(usage.CompletionTokens) +
                                 ", total " + Count(usage.TotalTokens));

            if (result.StreamId != null)
            {
                stderr.WriteLine("stats: stream id: " + result.StreamId + " (last event " +
                                 result.LastEventId.ToString(inv) + ")");
                stderr.WriteLine("stats: reconnects: " + result.Reconnects.ToString(inv));
            }

            if (result.Outcome == Outcome.Done && !string.IsNullOrEmpty(result.Done.Model))
                stderr.WriteLine("stats: model: " + result.Done.Model +
                                 (string.IsNullOrEmpty(result.Done.Id) ? "" : " (id " + result.Done.Id + ")"));
        }

        static string Count(long? n)
        {
            return n.HasValue ? n.Value.ToString(CultureInfo.InvariantCulture) : "?";
        }
    }
}
